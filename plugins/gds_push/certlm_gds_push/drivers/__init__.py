"""Device- and firmware-specific GDS push drivers: subclasses of ``GdsPushDriver`` for devices that differ."""
