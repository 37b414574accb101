"""Model sources: shipped configs per family, family detection, offline loading, built-in tiny models."""
