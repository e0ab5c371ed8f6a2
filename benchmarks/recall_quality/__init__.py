"""Recall quality: what the model is sent, question by question, from a fixed labelled set.

``uv run --python 3.12 python -m benchmarks.recall_quality`` seeds ``dataset.json`` into the real
Membase engine (``membase serve`` on loopback, with the deterministic stand-in LLM on loopback), asks
each question through a real Strands agent, and reports per configuration: the share of questions
whose fact was injected, the characters injected per turn, and the duplicate passages injected. With
``--write`` it replaces its part of ``benchmarks/RESULTS.md``.
"""
