//! The Porter stemmer exactly as nltk 3.10's `PorterStemmer()` runs it (mode
//! NLTK_EXTENSIONS), which rouge-score uses with `use_stemmer=True`.

/// Irregular forms that nltk's NLTK_EXTENSIONS mode maps directly, before any rule.
const IRREGULAR_FORMS: [(&str, &str); 16] = [
    ("sky", "sky"),
    ("skies", "sky"),
    ("dying", "die"),
    ("lying", "lie"),
    ("tying", "tie"),
    ("news", "news"),
    ("innings", "inning"),
    ("inning", "inning"),
    ("outings", "outing"),
    ("outing", "outing"),
    ("cannings", "canning"),
    ("canning", "canning"),
    ("howe", "howe"),
    ("proceed", "proceed"),
    ("exceed", "exceed"),
    ("succeed", "succeed"),
];

/// nltk 3.10's `PorterStemmer().stem(word)` (mode NLTK_EXTENSIONS), the stemmer rouge-score
/// uses. Each step mirrors nltk's method of the same name, including where nltk departs from
/// Porter's paper. `word` is a token of [`tokenize`]: ASCII lowercase letters and digits.
pub(crate) fn porter_stem(word: &str) -> String {
    if let Some((_, stem)) = IRREGULAR_FORMS.iter().find(|(form, _)| *form == word) {
        return stem.to_string();
    }
    if word.len() <= 2 || !word.is_ascii() {
        return word.to_string();
    }
    let word = step1a(word.to_string());
    let word = step1b(word);
    let word = step1c(word);
    let word = step2(word);
    let word = step3(word);
    let word = step4(word);
    let word = step5a(word);
    step5b(word)
}

/// Whether each letter is a consonant: not a vowel, and `y` only when it starts the word or
/// follows a vowel.
fn consonant_flags(word: &str) -> Vec<bool> {
    let mut flags: Vec<bool> = Vec::with_capacity(word.len());
    for (i, letter) in word.bytes().enumerate() {
        let consonant = match letter {
            b'a' | b'e' | b'i' | b'o' | b'u' => false,
            b'y' => i == 0 || !flags[i - 1],
            _ => true,
        };
        flags.push(consonant);
    }
    flags
}

fn is_consonant(word: &str, i: usize) -> bool {
    consonant_flags(&word[..=i])[i]
}

/// Porter's m: the number of vowel-consonant sequences in `[C](VC){m}[V]`.
fn measure(stem: &str) -> usize {
    consonant_flags(stem)
        .windows(2)
        .filter(|pair| !pair[0] && pair[1])
        .count()
}

fn contains_vowel(stem: &str) -> bool {
    consonant_flags(stem).iter().any(|&consonant| !consonant)
}

/// Porter's `*d`.
fn ends_double_consonant(word: &str) -> bool {
    let bytes = word.as_bytes();
    let n = bytes.len();
    n >= 2 && bytes[n - 1] == bytes[n - 2] && is_consonant(word, n - 1)
}

/// Porter's `*o` (consonant-vowel-consonant, the last not `w`, `x` or `y`), plus nltk's
/// extension: a two-letter vowel-consonant word.
fn ends_cvc(word: &str) -> bool {
    let n = word.len();
    if n == 2 {
        let flags = consonant_flags(word);
        return !flags[0] && flags[1];
    }
    if n < 3 {
        return false;
    }
    let flags = consonant_flags(word);
    flags[n - 3] && !flags[n - 2] && flags[n - 1] && !word.ends_with(['w', 'x', 'y'])
}

type Condition<'a> = &'a dyn Fn(&str) -> bool;

/// nltk's `_apply_rule_list`: the first rule whose suffix the word ends with decides; if its
/// condition on the remaining stem fails, the word stays as it is.
fn apply_rules(word: String, rules: &[(&str, &str, Condition)]) -> String {
    for &(suffix, replacement, condition) in rules {
        if let Some(stem) = word.strip_suffix(suffix) {
            return if condition(stem) {
                format!("{stem}{replacement}")
            } else {
                word
            };
        }
    }
    word
}

fn step1a(word: String) -> String {
    // nltk: "dies" -> "die" while "flies" -> "fli".
    if word.len() == 4 && word.ends_with("ies") {
        return format!("{}ie", &word[..1]);
    }
    let always: Condition = &|_| true;
    apply_rules(
        word,
        &[
            ("sses", "ss", always),
            ("ies", "i", always),
            ("ss", "ss", always),
            ("s", "", always),
        ],
    )
}

fn step1b(word: String) -> String {
    // nltk: "died" -> "die" while "spied" -> "spi".
    if let Some(stem) = word.strip_suffix("ied") {
        return if word.len() == 4 {
            format!("{stem}ie")
        } else {
            format!("{stem}i")
        };
    }
    if let Some(stem) = word.strip_suffix("eed") {
        return if measure(stem) > 0 {
            format!("{stem}ee")
        } else {
            word
        };
    }
    let Some(stem) = ["ed", "ing"]
        .iter()
        .find_map(|suffix| word.strip_suffix(suffix))
        .filter(|stem| contains_vowel(stem))
    else {
        return word;
    };
    if stem.ends_with("at") || stem.ends_with("bl") || stem.ends_with("iz") {
        format!("{stem}e")
    } else if ends_double_consonant(stem) {
        if stem.ends_with(['l', 's', 'z']) {
            stem.to_string()
        } else {
            stem[..stem.len() - 1].to_string()
        }
    } else if measure(stem) == 1 && ends_cvc(stem) {
        format!("{stem}e")
    } else {
        stem.to_string()
    }
}

fn step1c(word: String) -> String {
    // nltk: y -> i only after a consonant that is not the whole stem ("happy" -> "happi",
    // "enjoy" and "by" unchanged).
    match word.strip_suffix('y') {
        Some(stem) if stem.len() > 1 && is_consonant(stem, stem.len() - 1) => format!("{stem}i"),
        _ => word,
    }
}

fn step2(word: String) -> String {
    // nltk applies ALLI -> AL first and then step 2 again.
    if let Some(stem) = word.strip_suffix("alli") {
        if measure(stem) > 0 {
            return step2(format!("{stem}al"));
        }
    }
    let m_positive: Condition = &|stem| measure(stem) > 0;
    // nltk keeps the `l` of `logi` with the stem for the measure ("geologi" -> "geolog").
    let logi_stem_with_l = word.len().saturating_sub(3);
    let logi: Condition = &|_| measure(&word[..logi_stem_with_l]) > 0;
    let rules = [
        ("ational", "ate", m_positive),
        ("tional", "tion", m_positive),
        ("enci", "ence", m_positive),
        ("anci", "ance", m_positive),
        ("izer", "ize", m_positive),
        ("bli", "ble", m_positive),
        ("alli", "al", m_positive),
        ("entli", "ent", m_positive),
        ("eli", "e", m_positive),
        ("ousli", "ous", m_positive),
        ("ization", "ize", m_positive),
        ("ation", "ate", m_positive),
        ("ator", "ate", m_positive),
        ("alism", "al", m_positive),
        ("iveness", "ive", m_positive),
        ("fulness", "ful", m_positive),
        ("ousness", "ous", m_positive),
        ("aliti", "al", m_positive),
        ("iviti", "ive", m_positive),
        ("biliti", "ble", m_positive),
        ("fulli", "ful", m_positive),
        ("logi", "log", logi),
    ];
    apply_rules(word.clone(), &rules)
}

fn step3(word: String) -> String {
    let m_positive: Condition = &|stem| measure(stem) > 0;
    apply_rules(
        word,
        &[
            ("icate", "ic", m_positive),
            ("ative", "", m_positive),
            ("alize", "al", m_positive),
            ("iciti", "ic", m_positive),
            ("ical", "ic", m_positive),
            ("ful", "", m_positive),
            ("ness", "", m_positive),
        ],
    )
}

fn step4(word: String) -> String {
    let m_above_1: Condition = &|stem| measure(stem) > 1;
    let ion: Condition = &|stem| measure(stem) > 1 && stem.ends_with(['s', 't']);
    apply_rules(
        word,
        &[
            ("al", "", m_above_1),
            ("ance", "", m_above_1),
            ("ence", "", m_above_1),
            ("er", "", m_above_1),
            ("ic", "", m_above_1),
            ("able", "", m_above_1),
            ("ible", "", m_above_1),
            ("ant", "", m_above_1),
            ("ement", "", m_above_1),
            ("ment", "", m_above_1),
            ("ent", "", m_above_1),
            ("ion", "", ion),
            ("ou", "", m_above_1),
            ("ism", "", m_above_1),
            ("ate", "", m_above_1),
            ("iti", "", m_above_1),
            ("ous", "", m_above_1),
            ("ive", "", m_above_1),
            ("ize", "", m_above_1),
        ],
    )
}

fn step5a(word: String) -> String {
    match word.strip_suffix('e') {
        Some(stem) if measure(stem) > 1 || (measure(stem) == 1 && !ends_cvc(stem)) => {
            stem.to_string()
        }
        _ => word,
    }
}

fn step5b(word: String) -> String {
    // (m > 1 and *d and *L) -> single letter, the measure taken with one `l` left.
    if word.ends_with("ll") && measure(&word[..word.len() - 1]) > 1 {
        word[..word.len() - 1].to_string()
    } else {
        word
    }
}
