//! AFL++ target: `edgemoe_fuzz::harness::safetensors` on each input.

fn main() {
    edgemoe_fuzz::harness::init();
    afl::fuzz!(|data: &[u8]| {
        edgemoe_fuzz::harness::safetensors(data);
    });
}
