"""Rule-based rewards, the overlong penalty and the batch reward manager."""
