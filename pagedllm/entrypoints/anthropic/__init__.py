"""Anthropic's Messages API (/v1/messages), served by the chat path, so Claude Code and the anthropic SDK work."""
