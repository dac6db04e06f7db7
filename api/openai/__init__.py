"""The OpenAI-compatible API: routes, wire schemas, request inputs, formatting, SSE streaming, structured output and tool calling (tools/)."""
