"""Generated protobuf and gRPC modules of the public API (package mqds.v1).

Do not edit: run `make proto` after changing proto/mqds/v1/*.proto.
"""
