"""Tests of knitkit.admission."""
