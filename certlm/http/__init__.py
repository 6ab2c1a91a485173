"""The HTTP surface: the app factory, authentication, the OpenAPI description, the blueprints (routes are leaves
over the rooms below), static pages, the server and plugin loading. The top room of the host.
"""
