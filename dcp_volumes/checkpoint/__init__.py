"""The DCP side of dcp_volumes: storage writer/reader, manifest and checkpoint lifecycle."""
