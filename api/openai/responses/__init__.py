"""The OpenAI Responses API (/v1/responses) on the chat pipeline of api/openai/serving.py."""
