"""Reading shards: local, S3 and Energon datasets, tar members, blends, formats and filters."""
