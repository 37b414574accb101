"""Engine backends, one folder each, behind one builder/runner contract (see ``base``)."""
