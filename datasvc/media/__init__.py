"""Media: image and video headers, CPU and GPU decode, and the vision geometry (patches, grids)."""
