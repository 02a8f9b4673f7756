"""Generated protobuf and gRPC modules of EMQX's ExHook v3 interface (package emqx.exhook.v3).

Do not edit: run `make proto` after changing proto/mqds/broker/exhook/v3/exhook.proto.
"""
