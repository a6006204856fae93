//! ROUGE-1, ROUGE-2 and ROUGE-L of a prediction against a reference, computed exactly as
//! Google's `rouge-score` 0.1.2 does with
//! `rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL"], use_stemmer=stem)`, and a corpus
//! score as the mean of per-pair scores.
//!
//! - Tokens: lowercase, every character other than `a-z` and `0-9` becomes a space (so `é`, `ü`
//!   and curly quotes split words: `café` → `caf`), split on whitespace. With `stem`, tokens of
//!   more than 3 characters go through the Porter stemmer of nltk's `PorterStemmer()` in its
//!   default mode, NLTK_EXTENSIONS (not the original 1980 algorithm, not Snowball/Porter2).
//! - ROUGE-N: clipped n-gram matches over the prediction's n-grams (precision) and the
//!   reference's (recall). ROUGE-L: sentence-level longest common subsequence of the token
//!   sequences (not the summary-level `rougeLsum`). F-measure is `2PR / (P + R)`, 0 when both
//!   are 0. An empty prediction or reference scores 0 everywhere.
//! - Corpus score ([`mean`]): the arithmetic mean of each per-pair precision, recall and
//!   F-measure (not the F-measure of mean precision and recall). rouge-score's
//!   `BootstrapAggregator` reports as `mid` the median of bootstrap-resampled means, which is
//!   close to this mean but random; evaluation tools that report plain means report this.
//!
//! `tests/fixtures/rouge_golden.json` (made by `tests/fixtures/make_rouge_golden.py`) holds
//! rouge-score's values that the tests here match to 1e-9.
//!
//! Cost. Tokenizing, stemming and ROUGE-N are linear in the text. ROUGE-L's longest common
//! subsequence is exact, as rouge-score's, but where rouge-score fills an `n × m` table (hours
//! and gigabytes for two 1 MB lines) it is computed here bit-parallel (Hyyrö's bit-vector
//! algorithm): `n × m / 64` word operations and `O(n + m)` memory, so two 1 MB single-line
//! texts score in seconds. Pairs beyond [`MAX_LCS_CELLS`] (`n × m` > 2^38, e.g. two texts of
//! more than ~520,000 tokens each) are refused with an error rather than run for minutes: no
//! summary is that long, and rouge-score could not score them either.

use std::collections::HashMap;
use std::path::Path;

use serde::Serialize;

use crate::{Error, Result};

use super::porter::porter_stem;

/// Precision, recall and F-measure of one ROUGE variant.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Score {
    pub precision: f64,
    pub recall: f64,
    pub fmeasure: f64,
}

/// ROUGE-1, ROUGE-2 and ROUGE-L of one prediction (or the mean over a corpus).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct RougeScores {
    pub rouge1: Score,
    pub rouge2: Score,
    pub rouge_l: Score,
}

impl Score {
    pub const ZERO: Score = Score {
        precision: 0.0,
        recall: 0.0,
        fmeasure: 0.0,
    };

    /// rouge-score's arithmetic: `matches / max(total, 1)` on each side, then the F-measure.
    fn from_matches(matches: usize, prediction_total: usize, reference_total: usize) -> Score {
        let precision = matches as f64 / prediction_total.max(1) as f64;
        let recall = matches as f64 / reference_total.max(1) as f64;
        let fmeasure = if precision + recall > 0.0 {
            2.0 * precision * recall / (precision + recall)
        } else {
            0.0
        };
        Score {
            precision,
            recall,
            fmeasure,
        }
    }
}

/// rouge-score's default tokenizer: lowercase, non-`[a-z0-9]` characters to spaces, split on
/// whitespace; with `stem`, Porter-stem (nltk's default mode) every token longer than 3
/// characters.
pub fn tokenize(text: &str, stem: bool) -> Vec<String> {
    // Lowercasing can turn a non-ASCII character into ASCII (the Kelvin sign `K` becomes `k`,
    // `İ` becomes `i` + a combining dot), so lowercase first and filter afterwards, as Python's
    // `text.lower()` followed by the `[^a-z0-9]+` substitution does.
    let normalized: String = text
        .chars()
        .flat_map(char::to_lowercase)
        .map(|c| {
            if c.is_ascii_lowercase() || c.is_ascii_digit() {
                c
            } else {
                ' '
            }
        })
        .collect();
    normalized
        .split(' ')
        .filter(|token| !token.is_empty())
        .map(|token| {
            if stem && token.len() > 3 {
                porter_stem(token)
            } else {
                token.to_string()
            }
        })
        .collect()
}

/// Largest `prediction tokens × reference tokens` whose ROUGE-L is computed: 2^38, about
/// 4·10^9 word operations of the bit-parallel LCS (a few seconds). Covers any two texts of up to
/// ~520,000 tokens each, so any two 1 MB lines.
pub const MAX_LCS_CELLS: u64 = 1 << 38;

/// ROUGE-1, ROUGE-2 and ROUGE-L of `prediction` against `reference`. Fails ([`Error::Input`])
/// only when the two texts are too long for ROUGE-L ([`MAX_LCS_CELLS`]).
pub fn score(prediction: &str, reference: &str, stem: bool) -> Result<RougeScores> {
    let prediction = tokenize(prediction, stem);
    let reference = tokenize(reference, stem);
    let cells = (prediction.len() as u64).saturating_mul(reference.len() as u64);
    if cells > MAX_LCS_CELLS {
        return Err(Error::Input(format!(
            "ROUGE-L of a {}-token prediction against a {}-token reference is refused: more than 2^38 token pairs to compare (texts this long are not summaries; score them in pieces)",
            prediction.len(),
            reference.len()
        )));
    }
    Ok(RougeScores {
        rouge1: rouge_n(&prediction, &reference, 1),
        rouge2: rouge_n(&prediction, &reference, 2),
        rouge_l: rouge_l(&prediction, &reference),
    })
}

/// Corpus score: the arithmetic mean of every per-pair precision, recall and F-measure.
/// All zeros for no scores.
pub fn mean(scores: &[RougeScores]) -> RougeScores {
    let mean_of = |pick: fn(&RougeScores) -> Score| {
        if scores.is_empty() {
            return Score::ZERO;
        }
        let count = scores.len() as f64;
        let sum = |field: fn(&Score) -> f64| scores.iter().map(|s| field(&pick(s))).sum::<f64>();
        Score {
            precision: sum(|s| s.precision) / count,
            recall: sum(|s| s.recall) / count,
            fmeasure: sum(|s| s.fmeasure) / count,
        }
    };
    RougeScores {
        rouge1: mean_of(|s| s.rouge1),
        rouge2: mean_of(|s| s.rouge2),
        rouge_l: mean_of(|s| s.rouge_l),
    }
}

/// Scores line `i` of `pred` against line `i` of `reference` (one text per line, UTF-8; an
/// empty line is an empty text) and returns the per-line scores and their [`mean`].
pub fn score_files(
    pred: &Path,
    reference: &Path,
    stem: bool,
) -> Result<(Vec<RougeScores>, RougeScores)> {
    let predictions = crate::io::read_input_text(pred)?;
    let references = crate::io::read_input_text(reference)?;
    let predictions: Vec<&str> = predictions.lines().collect();
    let references: Vec<&str> = references.lines().collect();
    if predictions.len() != references.len() {
        return Err(Error::Input(format!(
            "ROUGE needs one prediction per reference line: {} has {} lines, {} has {}",
            pred.display(),
            predictions.len(),
            reference.display(),
            references.len()
        )));
    }
    if predictions.is_empty() {
        return Err(Error::Input(format!(
            "nothing to score: {} and {} are empty",
            pred.display(),
            reference.display()
        )));
    }
    let scores: Vec<RougeScores> = predictions
        .iter()
        .zip(&references)
        .enumerate()
        .map(|(i, (p, r))| {
            score(p, r, stem).map_err(|e| {
                Error::Input(format!(
                    "{} and {}, line {}: {e}",
                    pred.display(),
                    reference.display(),
                    i + 1
                ))
            })
        })
        .collect::<Result<_>>()?;
    let corpus = mean(&scores);
    Ok((scores, corpus))
}

/// Clipped n-gram overlap: each reference n-gram matches at most as often as it occurs in the
/// prediction.
fn rouge_n(prediction: &[String], reference: &[String], n: usize) -> Score {
    let prediction_ngrams = count_ngrams(prediction, n);
    let reference_ngrams = count_ngrams(reference, n);
    let matches: usize = reference_ngrams
        .iter()
        .map(|(ngram, &count)| count.min(prediction_ngrams.get(ngram).copied().unwrap_or(0)))
        .sum();
    Score::from_matches(
        matches,
        prediction.len().saturating_sub(n - 1),
        reference.len().saturating_sub(n - 1),
    )
}

fn count_ngrams(tokens: &[String], n: usize) -> HashMap<&[String], usize> {
    let mut counts = HashMap::new();
    for ngram in tokens.windows(n) {
        *counts.entry(ngram).or_insert(0) += 1;
    }
    counts
}

/// Sentence-level ROUGE-L: the longest common subsequence over each side's length.
fn rouge_l(prediction: &[String], reference: &[String]) -> Score {
    if prediction.is_empty() || reference.is_empty() {
        return Score::ZERO;
    }
    Score::from_matches(
        lcs_length(prediction, reference),
        prediction.len(),
        reference.len(),
    )
}

/// Length of the longest common subsequence, bit-parallel (Hyyrö 2004, after Allison and Dix
/// 1986): one bit per token of `a` in a vector `V` (all ones at first); for each token of `b`,
/// with `M` the positions of that token in `a`, `V ← (V + (V & M)) | (V & !M)`. The LCS is the
/// number of zero bits. `|b| × |a| / 64` word operations: a token frequent in `a` has its `M`
/// built once (at most `256` such tokens, `32 |a|` bytes in all), a rare one is written into a
/// scratch vector and cleared in fewer steps than the word loop takes; tokens of `b` absent
/// from `a` leave `V` unchanged, and words below a token's first position in `a` are skipped.
fn lcs_length(a: &[String], b: &[String]) -> usize {
    if a.is_empty() || b.is_empty() {
        return 0;
    }
    let words = a.len().div_ceil(64);
    let mut ids: HashMap<&str, usize> = HashMap::new();
    let mut positions: Vec<Vec<usize>> = Vec::new();
    for (i, token) in a.iter().enumerate() {
        let id = *ids.entry(token.as_str()).or_insert_with(|| {
            positions.push(Vec::new());
            positions.len() - 1
        });
        positions[id].push(i);
    }
    // Dense masks of the tokens that occur in at least a quarter as many places as `V` has
    // words: setting and clearing a rare token's bits costs at most half the word loop.
    let dense: Vec<Option<Vec<u64>>> = positions
        .iter()
        .map(|at| {
            (4 * at.len() >= words).then(|| {
                let mut mask = vec![0u64; words];
                for &p in at {
                    mask[p / 64] |= 1 << (p % 64);
                }
                mask
            })
        })
        .collect();
    let mut v = vec![u64::MAX; words];
    let mut scratch = vec![0u64; words];
    for token in b {
        let Some(&id) = ids.get(token.as_str()) else {
            continue;
        };
        let at = &positions[id];
        let m: &[u64] = match &dense[id] {
            Some(mask) => mask,
            None => {
                for &p in at {
                    scratch[p / 64] |= 1 << (p % 64);
                }
                &scratch
            }
        };
        let first = at[0] / 64;
        let mut carry = false;
        for (vk, &mk) in v[first..].iter_mut().zip(&m[first..]) {
            let old = *vk;
            let (sum, c1) = old.overflowing_add(old & mk);
            let (sum, c2) = sum.overflowing_add(carry as u64);
            carry = c1 || c2;
            *vk = sum | (old & !mk);
        }
        if dense[id].is_none() {
            for &p in at {
                scratch[p / 64] = 0;
            }
        }
    }
    // Zero bits among the first `a.len()` (carries may set or clear the padding above them).
    let full = a.len() / 64;
    let mut zeros: usize = v[..full].iter().map(|w| w.count_zeros() as usize).sum();
    let rest = a.len() % 64;
    if rest > 0 {
        zeros += (!v[full] & ((1u64 << rest) - 1)).count_ones() as usize;
    }
    zeros
}

/// The textbook dynamic programme, for the tests to check [`lcs_length`] against.
#[cfg(test)]
fn lcs_length_table(a: &[String], b: &[String]) -> usize {
    let mut previous = vec![0usize; b.len() + 1];
    let mut current = vec![0usize; b.len() + 1];
    for token_a in a {
        for (j, token_b) in b.iter().enumerate() {
            current[j + 1] = if token_a == token_b {
                previous[j] + 1
            } else {
                previous[j + 1].max(current[j])
            };
        }
        std::mem::swap(&mut previous, &mut current);
    }
    previous[b.len()]
}

#[cfg(test)]
mod tests {
    use super::*;

    use serde::Deserialize;

    #[derive(Deserialize)]
    struct Golden {
        pairs: Vec<GoldenPair>,
        mean: ByMode<GoldenScores>,
        stems: Vec<(String, String)>,
    }

    #[derive(Deserialize)]
    struct GoldenPair {
        prediction: String,
        reference: String,
        prediction_tokens: ByMode<Vec<String>>,
        reference_tokens: ByMode<Vec<String>>,
        scores: ByMode<GoldenScores>,
    }

    #[derive(Deserialize)]
    struct ByMode<T> {
        plain: T,
        stemmed: T,
    }

    impl<T> ByMode<T> {
        fn get(&self, stem: bool) -> &T {
            if stem {
                &self.stemmed
            } else {
                &self.plain
            }
        }
    }

    #[derive(Deserialize)]
    struct GoldenScores {
        rouge1: GoldenScore,
        rouge2: GoldenScore,
        #[serde(rename = "rougeL")]
        rouge_l: GoldenScore,
    }

    #[derive(Deserialize)]
    struct GoldenScore {
        precision: f64,
        recall: f64,
        fmeasure: f64,
    }

    fn golden() -> Golden {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/fixtures/rouge_golden.json"
        );
        let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{path}: {e}"));
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("{path}: {e}"))
    }

    fn assert_matches(actual: &RougeScores, expected: &GoldenScores, what: &str) {
        let variants = [
            ("rouge1", &actual.rouge1, &expected.rouge1),
            ("rouge2", &actual.rouge2, &expected.rouge2),
            ("rougeL", &actual.rouge_l, &expected.rouge_l),
        ];
        for (name, actual, expected) in variants {
            let fields = [
                ("precision", actual.precision, expected.precision),
                ("recall", actual.recall, expected.recall),
                ("fmeasure", actual.fmeasure, expected.fmeasure),
            ];
            for (field, actual, expected) in fields {
                assert!(
                    (actual - expected).abs() <= 1e-9,
                    "{what}: {name} {field}: rouge-score gives {expected}, we give {actual}"
                );
            }
        }
    }

    #[test]
    fn matches_rouge_score_on_golden_pairs() {
        let golden = golden();
        assert!(golden.pairs.len() >= 40);
        for stem in [false, true] {
            let mut all = Vec::new();
            for pair in &golden.pairs {
                let what = format!(
                    "stem={stem} prediction {:?} reference {:?}",
                    pair.prediction, pair.reference
                );
                assert_eq!(
                    tokenize(&pair.prediction, stem),
                    *pair.prediction_tokens.get(stem),
                    "{what}: prediction tokens"
                );
                assert_eq!(
                    tokenize(&pair.reference, stem),
                    *pair.reference_tokens.get(stem),
                    "{what}: reference tokens"
                );
                let scores = score(&pair.prediction, &pair.reference, stem).unwrap();
                assert_matches(&scores, pair.scores.get(stem), &what);
                all.push(scores);
            }
            assert_matches(
                &mean(&all),
                golden.mean.get(stem),
                &format!("stem={stem} mean"),
            );
        }
    }

    #[test]
    fn stems_like_nltk() {
        let golden = golden();
        assert!(!golden.stems.is_empty());
        for (word, stem) in &golden.stems {
            assert_eq!(porter_stem(word), *stem, "stem of {word:?}");
        }
    }

    #[test]
    fn tokenizes_like_rouge_score() {
        assert_eq!(
            tokenize("Don't STOP: café-crème, 2026!", false),
            ["don", "t", "stop", "caf", "cr", "me", "2026"]
        );
        assert_eq!(
            tokenize("The runners were running", true),
            ["the", "runner", "were", "run"]
        );
        // Tokens of 3 characters or fewer are never stemmed ("has" would stem to "ha").
        assert_eq!(tokenize("has does", true), ["has", "doe"]);
        assert!(tokenize(" \u{201c}\u{2014}\u{201d} ", true).is_empty());
    }

    #[test]
    fn empty_and_identical_texts() {
        let zero = RougeScores {
            rouge1: Score::ZERO,
            rouge2: Score::ZERO,
            rouge_l: Score::ZERO,
        };
        assert_eq!(score("", "a reference", false).unwrap(), zero);
        assert_eq!(score("a prediction", "", false).unwrap(), zero);
        assert_eq!(score("", "", true).unwrap(), zero);
        let one = Score {
            precision: 1.0,
            recall: 1.0,
            fmeasure: 1.0,
        };
        let same = score("The same text.", "the same text", false).unwrap();
        assert_eq!((same.rouge1, same.rouge2, same.rouge_l), (one, one, one));
    }

    #[test]
    fn corpus_score_is_the_mean_of_pair_scores() {
        let scores = [
            score("a b c d", "a b c d", false).unwrap(),
            score("a b", "c d", false).unwrap(),
        ];
        let corpus = mean(&scores);
        assert_eq!(corpus.rouge1.precision, 0.5);
        assert_eq!(corpus.rouge_l.fmeasure, 0.5);
        assert_eq!(mean(&[]).rouge2, Score::ZERO);
    }

    #[test]
    fn scores_files_line_by_line() {
        let dir = tempfile::tempdir().unwrap();
        let pred = dir.path().join("pred.txt");
        let reference = dir.path().join("ref.txt");
        std::fs::write(&pred, "the cat sat\n\nrunning fast\n").unwrap();
        std::fs::write(&reference, "the cat sat\nanything\r\nhe runs fast").unwrap();
        let (scores, corpus) = score_files(&pred, &reference, true).unwrap();
        assert_eq!(scores.len(), 3);
        assert_eq!(scores[0].rouge1.fmeasure, 1.0);
        assert_eq!(scores[1], score("", "anything", true).unwrap());
        assert_eq!(
            scores[2],
            score("running fast", "he runs fast", true).unwrap()
        );
        assert_eq!(corpus, mean(&scores));
    }

    /// The bit-parallel LCS equals the textbook table on random sequences over small alphabets
    /// (many repeats), across word boundaries (lengths around 64 and 128).
    #[test]
    fn bit_parallel_lcs_equals_the_table() {
        let mut state = 0x2545_f491_4f6c_dd1du64;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        for round in 0..400 {
            let alphabet = 1 + next() % 6;
            let (n, m) = (next() % 200, next() % 200);
            let a: Vec<String> = (0..n).map(|_| (next() % alphabet).to_string()).collect();
            let b: Vec<String> = (0..m).map(|_| (next() % alphabet).to_string()).collect();
            assert_eq!(
                lcs_length(&a, &b),
                lcs_length_table(&a, &b),
                "round {round}: {a:?} / {b:?}"
            );
        }
        let a: Vec<String> = (0..130).map(|i| (i % 3).to_string()).collect();
        assert_eq!(lcs_length(&a, &a), 130);
        assert_eq!(lcs_length(&a, &a[..64]), 64);
    }

    /// Two texts whose ROUGE-L would need more than 2^38 comparisons are refused, not run for
    /// minutes.
    #[test]
    fn refuses_texts_too_long_for_rouge_l() {
        let long = "a b ".repeat(300_000);
        let err = score(&long, &long, false).unwrap_err();
        assert!(matches!(err, Error::Input(_)), "{err:?}");
        assert!(err.to_string().contains("600000-token"), "{err}");
    }

    #[test]
    fn refuses_files_of_different_lengths() {
        let dir = tempfile::tempdir().unwrap();
        let pred = dir.path().join("pred.txt");
        let reference = dir.path().join("ref.txt");
        std::fs::write(&pred, "one\ntwo\n").unwrap();
        std::fs::write(&reference, "one\n").unwrap();
        let err = score_files(&pred, &reference, false).unwrap_err();
        assert!(matches!(err, Error::Input(_)), "{err:?}");
        let message = err.to_string();
        assert!(
            message.contains("pred.txt has 2 lines") && message.contains("ref.txt has 1"),
            "{message}"
        );

        let missing = dir.path().join("missing.txt");
        let err = score_files(&missing, &reference, false).unwrap_err();
        assert!(matches!(err, Error::Io { .. }), "{err:?}");
        assert!(err.to_string().contains("missing.txt"), "{err}");
    }
}
