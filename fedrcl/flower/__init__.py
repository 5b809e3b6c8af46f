"""fedrcl on Flower: the same client algorithms, server optimizers, seeds and numbers, as Flower apps.

- ``client.make_client_app()``: a ClientApp whose nodes run the client algorithm's own local update
  (``fedrcl.federated.local_update``) for the clients of their partition;
- ``strategy.FedrclStrategy``: a Flower Strategy around any fedrcl server optimizer, with fedrcl's seeded
  sampling and client-ordered float64 aggregation;
- ``server.make_server_app(args)`` / ``server.run_federation(grid, args)``: the run built from ``fedrcl fit``'s
  config, central evaluation and ``fedrcl fit``'s run folder;
- ``secure_aggregation``: each round's sum through Flower's SecAgg+ (run config ``secure-aggregation.enabled``);
- ``python -m fedrcl.flower --config ...``: the one-command simulation (``simulation``); ``app``: the apps
  ``flwr run`` loads. See ``docs/flower.md``.

Needs the ``flower`` extra (``pip install -e ".[flower]"``).
"""
