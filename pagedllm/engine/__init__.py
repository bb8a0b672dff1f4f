"""Joins scheduler and runner (EngineCore), and makes text for the front ends."""
