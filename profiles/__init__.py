"""Hardware profiles shipped as JSON data; loaded by name through :mod:`planner.hardware`."""
