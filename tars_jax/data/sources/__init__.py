"""Data sources: scripted experts, demonstrations, grounding examples, the browsing expert."""
