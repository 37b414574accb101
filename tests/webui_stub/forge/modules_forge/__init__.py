"""Forge's ``modules_forge`` package (its presence is how code tells Forge from A1111)."""
