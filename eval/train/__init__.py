"""Training the demo VLMs' vision towers on generated data (``towers.py``, issue 28)."""
