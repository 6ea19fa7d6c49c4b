"""Other serving systems, modelled from their published designs, that `medha simulate` runs on
the same requests and metrics as medha's replicas (ClusterConfig.system)."""
