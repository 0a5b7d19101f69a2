//! Digests of tensor bytes (BLAKE3), used to compare weights across runs.

/// Hex BLAKE3 digest of a sequence of f32 slices, taken over their little-endian bytes.
pub fn digest_f32<'a>(parts: impl IntoIterator<Item = &'a [f32]>) -> String {
    let mut h = blake3::Hasher::new();
    let mut buf = Vec::with_capacity(4096 * 4);
    for p in parts {
        for chunk in p.chunks(4096) {
            buf.clear();
            buf.extend(chunk.iter().flat_map(|x| x.to_le_bytes()));
            h.update(&buf);
        }
    }
    h.finalize().to_hex().to_string()
}

/// Hex BLAKE3 digest of raw bytes.
pub fn digest_bytes(bytes: &[u8]) -> String {
    blake3::hash(bytes).to_hex().to_string()
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn digest_is_over_le_bytes() {
        let v = [1.0f32, -2.5, 3.25];
        let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
        assert_eq!(digest_f32([&v[..]]), digest_bytes(&bytes));
        // Split into parts gives the same digest as one part.
        assert_eq!(digest_f32([&v[..1], &v[1..]]), digest_bytes(&bytes));
        assert_ne!(digest_f32([&v[..2]]), digest_bytes(&bytes));
    }
}
