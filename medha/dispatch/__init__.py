"""Global dispatch: which replica a new request goes to, for `medha simulate --replicas N` and
`medha route` alike (base_dispatcher.py). The settings and names are in config.py, which the
CLI's parser imports: nothing here imports the dispatchers, the scheduler or numpy."""
