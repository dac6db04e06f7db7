"""The HTTP server: the app factory, lifespan, middleware, errors, body limits, OpenAPI, settings, observability (metrics, traces, logs) and the offload pool."""
