"""certlm's OPC UA GDS Push plugin: manages OPC UA devices through the Part 12 push certificate management model."""
