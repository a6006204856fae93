//! AFL++ target: `edgemoe_fuzz::harness::tokenizer` on each input.

fn main() {
    edgemoe_fuzz::harness::init();
    afl::fuzz!(|data: &[u8]| {
        edgemoe_fuzz::harness::tokenizer(data);
    });
}
