"""Text and packing: token rows from samples, packed rows, block sizing and the epoch plan."""
