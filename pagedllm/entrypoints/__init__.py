"""What people use: the offline LLM API, the CLI and the OpenAI-compatible server."""
