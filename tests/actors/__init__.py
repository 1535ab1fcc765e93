"""Tests of agent.actors."""
