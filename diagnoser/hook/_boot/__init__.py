"""The directory `python -m diagnoser.hook` puts on PYTHONPATH (holds sitecustomize.py)."""
