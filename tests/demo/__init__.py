"""Tests of the demo inference server (agent/demo)."""
