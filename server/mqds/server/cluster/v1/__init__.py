"""Generated protobuf and gRPC modules. Do not edit: run `make proto`."""
