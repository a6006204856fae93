//! AFL++ target: `edgemoe_fuzz::harness::store` on each input.

fn main() {
    edgemoe_fuzz::harness::init();
    afl::fuzz!(|data: &[u8]| {
        edgemoe_fuzz::harness::store(data);
    });
}
