"""The API layer: translates gRPC requests to the storage layer and errors to statuses."""
