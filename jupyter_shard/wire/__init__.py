"""The wire between a pool's driver and its ranks: the message registry (``messages``), signing and
framing (``protocol``) and CurveZMQ for ranks on other hosts (``curve``). Both sides import it; it
imports nothing of the package but ``env`` and ``errors``."""
