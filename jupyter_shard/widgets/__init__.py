"""What the notebook shows: rank output now; the dashboard and strategy picker build on it."""
