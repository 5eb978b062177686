"""A rank's stream: work items through the stages, blocks produced, balanced and recovered."""
