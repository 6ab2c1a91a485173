"""The HTTP surface: the app factory, authentication, the OpenAPI description, the blueprints (routes are leaves
over the rooms below), static pages, the server and plugin loading. The top room of the host: it imports every room
below it, and only the CLI, the demo and the test kit import it.
"""
