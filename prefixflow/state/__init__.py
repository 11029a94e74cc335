"""What a layer keeps at a cached boundary: prefix K/V (attention), end states (recurrent layers)."""
