"""Model definitions. Models know nothing of distribution: see pretrain.parallel.parallelize."""
