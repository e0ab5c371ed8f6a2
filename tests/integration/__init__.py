"""Tests against the real Membase engine on loopback (Python 3.12+, the local extra)."""
