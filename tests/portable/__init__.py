"""The backend-agnostic tests: run under KERAS_BACKEND=jax, torch and tensorflow (a package, so that its
conftest.py is `portable.conftest` beside tests/conftest.py, not in its place)."""
