"""The engine cache: engine files on disk, an index, locks and checksums."""
