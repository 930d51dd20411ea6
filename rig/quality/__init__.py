"""The quality battery: suites in quality/, one module per concern here, `inv quality` in rig/cli/quality.py."""
