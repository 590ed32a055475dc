"""The one place that knows etcd: the store adapter, the key layout, fencing and the torch Store on etcd.

Rendezvous, restart, RPC membership and the operator reach etcd only through this package.
"""
