"""Test-suite setup shared by every part."""
