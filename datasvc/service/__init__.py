"""The Ray service: a feeder actor per rank, the preprocessing pool, and the trainer's client."""
