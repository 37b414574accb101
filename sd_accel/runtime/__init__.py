"""Engine-backed modules swapped into a diffusers pipeline, engine choice per call, stats."""
