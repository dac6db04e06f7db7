"""The Anthropic Messages API (/v1/messages) on the chat pipeline of api/openai/."""
