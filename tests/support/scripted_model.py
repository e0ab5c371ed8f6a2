"""The scripted model now ships in the public testing kit; this name stays for the tests."""

from membase_strands.testing import ScriptedModel, ToolCall

__all__ = ["ScriptedModel", "ToolCall"]
