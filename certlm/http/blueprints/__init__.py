"""The REST interface, one module per area of the spec."""
