"""The per-pod agent (``stalwart agent -- CMD...``) and the parts it runs on.

* :mod:`stalwart.agent.runner`: the agent itself (rendezvous join, rank processes, supervision, progress);
* :mod:`stalwart.agent.settings`: its settings from the pod environment;
* :mod:`stalwart.agent.supervision`: what it does about its rank processes (a pure function);
* :mod:`stalwart.agent.rendezvous`, :mod:`stalwart.rpc`: the node rendezvous and the RPC layer.
"""
