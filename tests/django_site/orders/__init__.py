"""The example app: one model, one leased task."""
